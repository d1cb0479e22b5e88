"""Command-line tools: `python -m tools.trace` (per-token padding trace), `python -m tools.stages`
(per-stage reference vs kernel comparison), `python -m tools.bench` (GPU timings)."""
