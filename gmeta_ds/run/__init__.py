"""One training run of the CLI: the loop (`trainer`), what it records (`run_log`), what it
leaves in output_dir (`outputs`), where a step's time goes (`profiling`), the tuning search
(`tune`) and what launchers hand to a rank (`launchers`).

Importing the package imports nothing else: `launchers` and `tune` are layer 0 (no torch)."""
