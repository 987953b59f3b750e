"""``python -m probe ...`` (and ``torchrun ... -m probe run ...``): the command line of ``cli.py``."""

from cli import main

main()
