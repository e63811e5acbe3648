"""`python -m pdkv`: the `pdkv` command."""

from pdkv.cli import main

main()
