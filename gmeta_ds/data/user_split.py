"""The seeded split of kept tasks (users) into training, validation and held-out ones,
shared by the in-memory builder (`builder.py`) and the out-of-core one (`stream.py`)."""
from __future__ import annotations

import numpy as np

from gmeta_ds.errors import DataError

TRAIN, VALID, TEST = 0, 1, 2


def split_users(kept_tasks: np.ndarray, test_fraction: float, valid_fraction: float,
                 seed: int) -> np.ndarray:
    """Per kept task: TRAIN, VALID or TEST (seeded; the test users do not depend on
    ``valid_fraction``)."""
    rng = np.random.default_rng([seed, 23])
    n_test = max(1, int(round(test_fraction * len(kept_tasks))))
    n_valid = int(round(valid_fraction * len(kept_tasks)))
    if n_test + n_valid >= len(kept_tasks):
        raise DataError(f"only {len(kept_tasks)} task(s) left after filtering: too few to hold out "
                        f"{test_fraction:.0%} (+ {valid_fraction:.0%} validation) and still train")
    split = np.full(len(kept_tasks), TRAIN, dtype=np.int8)
    order = rng.permutation(len(kept_tasks))
    split[order[:n_test]] = TEST
    split[order[n_test:n_test + n_valid]] = VALID
    return split
