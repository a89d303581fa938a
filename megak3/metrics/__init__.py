"""Training telemetry: progress bar, console lines, JSONL, offline wandb, NVML and memory readings."""
from megak3.metrics.config import LoggingConfig
from megak3.metrics.logger import TrainLogger
from megak3.metrics.telemetry import GPUTelemetry, Throughput, peak_memory_mb, peak_memory_source

__all__ = ["LoggingConfig", "TrainLogger", "GPUTelemetry", "Throughput", "peak_memory_mb",
           "peak_memory_source"]
