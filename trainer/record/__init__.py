"""Record: what a run directory holds and says about the run.

``names`` names the run directory's files; ``record`` writes ``record.json`` (bundle revision, launcher packages,
lock hashes, status); ``rundir`` claims and reads run directories; ``verify`` compares what a run observed (its
probe, run by :mod:`trainer.probe` inside the job) with its lock; ``attest`` and ``keygen`` sign runs; ``status``
follows a run (its Slurm job) to its end. Within the package each imports only those below it: ``names``,
``record``; ``verify``; ``attest`` (it signs verify's verdict); ``rundir`` (it writes the attestation when it seals a
run); the commands ``attest_cli`` (``trainer attest``), ``verify_cli`` (``trainer verify``) and ``status`` on top.
"""
