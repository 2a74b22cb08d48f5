"""The engine: plans, buffers, negotiation into a CallPlan, the pipeline that
executes it, the settle step, dtypes, pytrees and the array bridge."""
