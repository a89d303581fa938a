"""What a run tells its operator: the start-up summary, FLOPs per token, MFU and the resolved config.

FLOPs per token come from the planner's count (``megak3.launch.planner.flops_per_token``: 2 x the
active parameters per token for the matmuls, plus MLA scores and the KDA recurrence; training =
3 x forward). The peak a rank is measured against comes from conf/hardware/: the GPU's dense
BF16 / FP32 figure for its model name (h100, h200, b200); on CPU it is measured at start-up: the
best of a few fp32 1024 x 1024 matmuls on the rank's torch threads (~0.1 s), so MFU on a CPU is
"of what this machine's matmul reaches now" (a machine shared with other jobs shows it).
MFU = achieved FLOP/s per rank / that peak.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ..config import ModelConfig


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per text token."""
    from ..launch.planner import flops_per_token

    return float(flops_per_token(cfg, seq_len)["train"])


def peak_flops_per_rank(device: torch.device, precision: str) -> Optional[tuple]:
    """(peak FLOP/s of one rank, what it is) from conf/hardware/, or None when unknown."""
    from ..launch.hardware import hardware_names, load_hardware

    key = "bf16_flops" if precision == "bf16" else "fp32_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        match = next((h for h in hardware_names() if h != "cpu" and h in name), None)
        if match is None:
            return None
        return getattr(load_hardware(match), key), f"{match} {precision}"
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return measured_cpu_matmul_flops(), f"cpu fp32 matmul measured at start-up, {threads} thread(s)"
    return None


def measured_cpu_matmul_flops(n: int = 1024, reps: int = 6) -> float:
    """FLOP/s of the fastest of ``reps`` fp32 ``[n, n] @ [n, n]`` matmuls on the current threads."""
    import time

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    torch.mm(a, b)  # warm-up: first-call dispatch and page faults
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def throughput_metrics(tokens_per_s: float, flops_per_token: float, world: int, peak: Optional[tuple]) -> dict:
    """``tflops_per_rank`` and, with a known peak, ``mfu`` for a window's tokens/s (all ranks)."""
    per_rank = tokens_per_s * flops_per_token / max(world, 1)
    out = {"tflops_per_rank": per_rank / 1e12}
    if peak is not None and peak[0] > 0:
        out["mfu"] = per_rank / peak[0]
    return out


def startup_lines(job, ps, plan, model, run_dir, dataset_prefix, num_tokens: int, grad_accum: int,
                  flops_per_token: float, peak: Optional[tuple], config_path: Optional[Path] = None) -> list:
    """The lines rank 0 prints before the first step."""
    from ..model.param_count import count_parameters

    cfg, t, d = job.model, job.train, job.data
    counts = count_parameters(cfg)
    kinds = cfg.layer_kinds()
    local = sum(p.numel() for p in model.parameters())
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layers = ", ".join(f"{c.start}-{c.stop - 1}" for c in plan.stage_chunks)
    tokens_per_step = t.global_batch_size * d.seq_len
    lines = [
        f"run dir {Path(run_dir).resolve()}" + (f" (resolved config: {config_path.name})" if config_path else ""),
        f"model {cfg.name}: {counts['total'] / 1e6:,.1f} M parameters, {counts['active'] / 1e6:,.1f} M active per "
        f"token; {cfg.num_layers} layers ({kinds.count('kda')} KDA, {kinds.count('mla')} MLA), "
        f"{cfg.moe.num_experts} experts top-{cfg.moe.top_k}, vocab {cfg.vocab_size}",
        f"layout {ps.world_size} rank(s): tp {ps.tp_size} x cp {ps.cp_size} x dp {ps.dp_size} x pp {ps.pp_size}"
        f" (vp {job.parallel.vp}, {job.parallel.pp_schedule if ps.pp_size > 1 else 'no pipeline'}); "
        f"ep {ps.ep_size} x edp {ps.edp_size}; sp {'on' if plan.sequence_parallel else 'off'}; rank 0 holds "
        f"{local / 1e6:,.1f} M parameters ({local_bytes / 2 ** 20:,.1f} MiB), layers {layers}",
        f"data {dataset_prefix} ({num_tokens:,} tokens); seq_len {d.seq_len}, global batch {t.global_batch_size}"
        f" = {tokens_per_step:,} tokens per step, {grad_accum} micro-batch(es) of {t.micro_batch_size} per rank",
        f"compute {flops_per_token / 1e9:,.3f} GFLOP per token (training); "
        + (f"peak per rank {peak[0] / 1e12:,.3f} TFLOP/s ({peak[1]})" if peak else "peak unknown: no MFU"),
    ]
    return lines


def save_config(run_dir, config_dict: Optional[dict]) -> Optional[Path]:
    """Write the resolved config as RUN_DIR/config.yaml (returns its path; None without a config)."""
    if config_dict is None:
        return None
    import yaml

    path = Path(run_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(config_dict, sort_keys=False))
    tmp.replace(path)
    return path


def save_tokenizer(run_dir, tokenizer_path) -> Path:
    """Copy the run's tokenizer to RUN_DIR/tokenizer.json (atomically), so the run directory alone is
    enough to generate from (megak3.inference.loading looks there first)."""
    import shutil

    path = Path(run_dir) / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    shutil.copyfile(tokenizer_path, tmp)
    tmp.replace(path)
    return path

