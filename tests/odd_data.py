"""A dataset of a user's own with structured batches: `data._target_=tests.odd_data.<name>` on top
of `data=synthetic`, whose settings it takes."""

from __future__ import annotations

from typing import Any

from src.components.data import synthetic_classification
from src.components.data_contract import Data, Split


def halves_and_values(seed: int, **settings: Any) -> Data:
    """`data=synthetic`'s samples (its `settings`) as dicts: inputs {"left", "right"} (the two
    halves of the features), targets {"label": the class, "value": the features' mean}."""
    data = synthetic_classification(seed, **settings)
    train, val, test = (as_dicts(split) for split in data.splits)
    return Data(train, val, test, data.input_shape, data.num_classes)


def as_dicts(split: Split) -> Split:
    features = split.inputs.flatten(1)
    half = features.shape[1] // 2
    inputs = {"left": features[:, :half], "right": features[:, half:]}
    return Split(inputs, {"label": split.targets, "value": features.mean(1)})


def vectors(seed: int, input_dim: int, num_classes: int, num_samples: int) -> Data:
    """A builder that names its settings rather than taking `**settings`: on top of
    `data=synthetic`, the option's others (val_fraction, image_shape, ...) reach it too."""
    return synthetic_classification(seed, input_dim, num_classes, num_samples, 0.1, 0.1)
