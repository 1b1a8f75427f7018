"""`python -m ggwgpu`: the `ggwgpu` command."""
from ggwgpu_cli.main import cli

if __name__ == "__main__":
    cli(prog_name="ggwgpu")
