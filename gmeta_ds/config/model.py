"""``model``: the CTR model's name and hyper-parameters, and their own checks."""
from __future__ import annotations

from dataclasses import dataclass, field

from gmeta_ds.config.checks import one_of, check_positive
from gmeta_ds.registry import MODELS

# model.name -> its default meta.adapt where that is not MetaConfig's ["mlp.*"] (the class's
# ``default_adapt``; tests/unit/test_input_matrix.py keeps the two equal).
MODEL_DEFAULT_ADAPT = {"two_tower": ("user_tower.*",)}


@dataclass
class ModelConfig:
    """The CTR model (``task: ctr``): ``name`` is one of `registry.MODELS` (models/). The other
    keys are the models' hyper-parameters, flat; each model reads only its own."""

    name: str = "melu"                        # melu | dcn_v2 | deepfm | wide_deep | dlrm | two_tower
    embed_dim: int = 16                    # row width d of every embedding table
    # MeLU's MLP; the deep part of dcn_v2, deepfm, wide_deep; DLRM's top MLP.
    hidden: list[int] = field(default_factory=lambda: [64, 32])
    cross_layers: int = 2                     # dcn_v2: cross layers
    bottom_hidden: list[int] = field(default_factory=list)  # dlrm: hidden widths of the bottom projection (d -> ... -> d)
    tower_hidden: list[int] = field(default_factory=lambda: [64, 32])  # two_tower: each tower; the last = dot-product dim
    # Every model: add the training users' item popularity (shrunk click log-odds / mean rating)
    # as a logit offset, weight * popularity + bias (models/popularity.py; popularity.* in meta.adapt).
    item_popularity: bool = False
    popularity_prior: float = 10.0            # pseudo-interactions at the global rate per item
    # With item_popularity: the statistic also enters the model's input, s * popularity.feature
    # (a learned row, zeros at start) added to the item field's row, so the layers can combine it
    # with the user's features.
    popularity_feature: bool = False
    # The last linear layer of ``mlp`` starts at zero (melu, dcn_v2, dlrm: the whole output, so
    # with item_popularity the model starts as popularity alone; deepfm, wide_deep: the deep part).
    zero_init_output: bool = False



def validate_model(m: ModelConfig, problems: list[str]) -> None:
    """``model.*`` on its own: a registered name, positive widths, layers and prior."""
    one_of(problems, "model.name", m.name, MODELS.names())
    for key in ("hidden", "bottom_hidden", "tower_hidden"):
        widths = getattr(m, key)
        if any(h <= 0 for h in widths):
            problems.append(f"model.{key}: {widths!r} must be positive layer widths")
    if not m.tower_hidden:
        problems.append("model.tower_hidden: empty; the last width is the two towers' dot-product dimension")
    check_positive(problems, "model.cross_layers", m.cross_layers)
    check_positive(problems, "model.popularity_prior", m.popularity_prior)
