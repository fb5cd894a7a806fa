"""Report: what a finished run measured and whether it converged.

``metrics`` reads ``metrics.jsonl`` and computes throughput, MFU and cost; ``report`` prints them;
``convergence`` is the convergence check and ``convergence_cli`` its command (``trainer converge``);
``recipe`` writes a run as a recipe YAML; ``logs`` reads Megatron/miles logs into metrics; ``plots`` draws.
"""
