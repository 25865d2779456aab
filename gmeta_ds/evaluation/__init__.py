"""Evaluation: the one evaluation of held-out users that the API and the CLI both run
(`held_out`), their scores (`scores`), the cold-start metrics (`metrics`),
baselines (`baselines`), paired intervals (`intervals`), few-shot curves (`few_shot`),
repeated splits (`splits`), the report page (`report`) and its plots (`plots`).

Importing the package imports nothing else: `metrics`, `intervals`, `report` and `plots` sit
in low layers (no torch for `report` and `plots`) and stay importable without the rest."""
