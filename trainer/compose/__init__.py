"""Compose and check: the run as Hydra composes it from ``conf/``, typed, checked, rendered and planned.

``schema`` types every field; ``compose`` composes with Hydra's Compose API and reports errors on one line;
``checks`` holds the pre-launch arithmetic (world size, DP, expert grid, pipeline split, ...); ``render``
maps the composition to the miles launch (argv + env); ``params`` counts parameters from shapes; ``plan``
estimates memory per GPU and writes the plan; ``numerics`` compares two compositions argument by argument;
``stackpins`` checks ``conf/stack`` against ``lockfiles/stack.json``; ``summary`` prints the plan.
``prepare`` is the whole compose -> check phase of one job (a read-only ``PreparedRun``, its values made
read-only by ``frozen``), ``commandline`` prepares every job of ``train``'s command line before any runs and runs a
single one in Hydra's run directory, and ``cache`` keeps compositions content-addressed so that composing again
costs a file read.
"""
