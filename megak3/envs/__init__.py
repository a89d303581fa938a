"""Agent environments: recoverable process sandboxes for multi-turn tool use (docs/INTERFACES.md)."""
from megak3.envs.driver import EpisodeDriver
from megak3.envs.env import Environment, SandboxEnv, StepResult
from megak3.envs.pool import EnvError, EnvPool, StepBatchError
from megak3.envs.process_backend import WorkerDied
from megak3.envs.sandbox import SandboxLimits
from megak3.envs.snapshot import SnapshotRefused, SnapshotStore, StoreLimits
from megak3.envs.tasks import make_task
from megak3.envs.toolcall import ToolCall, parse_tool_call

__all__ = ["EpisodeDriver", "Environment", "SandboxEnv", "StepResult", "EnvError", "EnvPool", "StepBatchError",
           "WorkerDied", "SandboxLimits",
           "SnapshotRefused", "SnapshotStore", "StoreLimits", "make_task", "ToolCall", "parse_tool_call"]
