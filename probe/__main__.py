"""``python -m probe ...`` (and ``torchrun ... -m probe run ...``): the command line of ``probe/cli.py``."""

from probe.cli import main

main()
