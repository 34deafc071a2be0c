"""``python -m kvxfer.cli``: the same as the ``kvxfer`` command."""
from kvxfer.cli.main import main

main()
