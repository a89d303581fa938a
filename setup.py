"""megak3: Megatron-style 3D-parallel training for Kimi-K3-architecture models.

Installs three packages: ``megak3`` (model + training program), ``parallel`` (process groups and
parallel layouts) and ``moonep`` (expert parallelism). Install with ``bash tools/bootstrap.sh``,
which pins torch==2.13.0 through ``tools/constraints.txt`` before anything else.
"""
from setuptools import find_packages, setup


def _optional_extensions():
    """csrc/moonep_planner.cpp as ``moonep._planner_cpp``; absent torch/compiler -> no extension."""
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        return [], {}

    class OptionalBuildExt(BuildExtension):
        # A failed compile must not fail the install: moonep falls back to the torch planner.
        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001
                print(f"WARNING: optional extension {ext.name} not built ({exc}); using the torch planner")

    ext = CppExtension("moonep._planner_cpp", ["csrc/moonep_planner.cpp"], extra_compile_args=["-O3"])
    return [ext], {"build_ext": OptionalBuildExt.with_options(no_python_abi_suffix=False)}


EXT_MODULES, CMDCLASS = _optional_extensions()

RUNTIME = [
    "torch>=2.5,<2.14",          # 2.13.0 is the tested build; the constraints file pins it
    "numpy>=1.24",
    "hydra-core>=1.3,<1.4",
    "omegaconf>=2.3,<2.4",
    "tokenizers>=0.15",
    "tqdm>=4.60",
    "wandb>=0.16",
    "safetensors>=0.4",          # Hugging Face import/export (megak3/interop, tools/convert_hf.py)
    "nvidia-ml-py>=12",          # GPU telemetry; skipped with one notice when NVML is absent
    "fastapi>=0.115",            # the OpenAI server (megak3/inference/server.py); tested 0.165.0
    "uvicorn>=0.30",             # its ASGI server; tested 0.55.0
    "pydantic>=2.7,<3",          # request/response schemas (megak3/inference/api_models.py); tested 2.14.4
    "prometheus_client>=0.20",   # GET /metrics; tested 0.26.0
]
DEEPSPEED = "deepspeed==0.19.8"
RAY = "ray>=2.50,<3"
LM_EVAL = "lm-eval>=0.4.13,<0.5"   # tested 0.4.13; installs against the pinned CPU torch
EXTRAS = {
    # GPU-only accelerators; every path they serve has a pure-torch twin used on CPU.
    # NVIDIA apex is not on PyPI (PyPI's "apex" is unrelated) and is only imported if the user built it.
    # fla-core 0.4.2 added chunk_kda's safe_gate / lower_bound / cu_seqlens_cpu (megak3/ops/kda/dispatch.py);
    # TE 2.2 has Float8CurrentScaling and MXFP8BlockScaling, TE 2.3 added Float8BlockScaling (Hopper,
    # CUDA >= 12.9); megak3/quant/te.py picks per GPU, CUDA and TE version and refuses delayed scaling
    "gpu": ["transformer_engine[pytorch]>=2.2", "fla-core>=0.4.2,<0.6"],
    # optim.offload=cpu's DeepSpeed CPU Adam kernel (JIT-built on first use; the torch twin serves
    # without it). Tested version; an sdist: install with --no-build-isolation so it sees the torch pin.
    "offload": [DEEPSPEED],
    # megak3/envs' worker pool on Ray (EnvPool(backend="ray")); 2.60.0 is the tested version
    "ray": [RAY],
    # torchao: an independent MX reference in tests (tests skip it when absent); deepspeed: the
    # offload kernel the tests compare with its torch twin; ray: tests/test_envs_ray.py; lm-eval:
    # tests/test_lm_eval.py
    "dev": ["pytest>=7.4", "pytest-xdist>=3.3", "pytest-timeout>=2.1", "matplotlib>=3.7", "ninja>=1.11",
            "torchao>=0.10", DEEPSPEED, RAY, LM_EVAL],
    # the lm-evaluation-harness model "megak3" (megak3/inference/lm_eval_adapter.py, megak3-lm-eval)
    "eval": [LM_EVAL],
}

setup(
    name="megak3",
    version="0.1.0",
    description="Megatron-style 3D-parallel training system for Kimi-K3-architecture models",
    python_requires=">=3.10",
    packages=find_packages(include=["megak3", "megak3.*", "parallel", "parallel.*", "moonep", "moonep.*"]),
    install_requires=RUNTIME,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["megak3=megak3.__main__:main",
                                      "megak3-train=megak3.train.__main__:main",
                                      "megak3-generate=megak3.inference.cli:main",
                                      "megak3-lm-eval=megak3.inference.lm_eval_adapter:main"]},
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
)
