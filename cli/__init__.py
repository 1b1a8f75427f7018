"""The `ggwgpu` command-line app (installed as the ggwgpu_cli package)."""
