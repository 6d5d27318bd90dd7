"""A strategy of a user's own, outside `src/`: named by
`parallel._target_=tests.odd_strategies.<Name>`."""

from __future__ import annotations

from src.parallel.strategies.single import Single


class Unpriced(Single):
    """`single` without a cost model: it trains, and the planner refuses it in one line."""

    def cost_model(self) -> None:
        return None
