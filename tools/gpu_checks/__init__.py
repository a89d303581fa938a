"""The parts of tools/gpu_check.py, one module per topic (the driver, its CLI and its JSON report
live in tools/gpu_check.py): common.py (tolerances, the Check collector, timing), kda.py (part a),
attention.py (b), grouped_gemm.py (c), training.py (d, e, f: through RankStep), apex.py (g)."""
