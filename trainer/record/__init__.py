"""Record: what a run directory holds and says about the run.

``record`` writes ``record.json`` (bundle revision, launcher packages, lock hashes, status); ``rundir``
claims and reads run directories; ``verify`` compares what a run observed (its probe, run by
:mod:`trainer.probe` inside the job) with its lock; ``attest`` and ``keygen`` sign runs; ``status`` follows a
run (its Slurm job) to its end.
"""
