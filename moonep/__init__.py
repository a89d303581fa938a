"""moonep: expert parallelism where every EP rank computes exactly S*K rows (issue 6)."""
from .planner import Plan, plan_moonep  # noqa: F401
