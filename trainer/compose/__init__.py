"""Compose and check: the run as Hydra composes it from ``conf/``, typed, checked, rendered and planned.

``schema`` types every field; ``compose`` composes with Hydra's Compose API and reports errors on one line;
``checks`` holds the pre-launch arithmetic (world size, DP, expert grid, pipeline split, ...); ``render``
maps the composition to the miles launch (argv + env); ``params`` counts parameters from shapes; ``plan``
estimates memory per GPU and writes the plan; ``numerics`` compares two compositions argument by argument;
``stackpins`` checks ``conf/stack`` against ``lockfiles/stack.json``; ``summary`` prints the plan.
"""
