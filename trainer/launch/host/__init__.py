"""The host side of the launchers: what ``train launcher=...`` runs on the machine it is started on.

``local_cpu``, ``local_megatron``, ``local_image``, ``slurm`` and ``ray`` are the launchers of
:data:`trainer.launch.LAUNCHERS`; ``cluster``, ``checkout`` and ``processes`` are their shared helpers. What
runs inside the job lives one level up, in :mod:`trainer.launch` (its module paths are part of the scripts
the launchers write).
"""
