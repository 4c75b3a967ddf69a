"""A mixed-integer linear program built row by row and solved by HiGHS (``scipy.optimize.milp``):
the pipeline planner's partition and the memory planner's plan are both written in it."""

from typing import Dict, List, Tuple

import numpy as np

from ._optional import import_optional

__all__ = ["Expression", "LinearProgram", "combine", "var", "const"]

Expression = Tuple[Dict[int, float], float]  # coefficients by variable, and a constant


class LinearProgram:
    """Variables and rows ``lower <= sum(coef * var) + const <= upper``, built incrementally."""

    def __init__(self) -> None:
        self.lower: List[float] = []
        self.upper: List[float] = []
        self.integer: List[int] = []
        self.rows: List[Tuple[Dict[int, float], float, float]] = []

    def variable(self, lower=0.0, upper=np.inf, integer=False) -> int:
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(int(integer))
        return len(self.lower) - 1

    def constrain(self, expression: Expression, lower=-np.inf, upper=np.inf) -> None:
        coefficients, constant = expression
        self.rows.append((coefficients, lower - constant, upper - constant))

    def solve(self, objective: Dict[int, float], time_limit_s: float):
        """Minimise ``sum(objective[v] * v)`` with HiGHS (``scipy.optimize.milp``) within
        ``time_limit_s``; scipy's result."""
        optimize = import_optional("scipy.optimize", "planner", "Planning by integer program")
        sparse = import_optional("scipy.sparse", "planner", "Planning by integer program")
        cost = np.zeros(len(self.lower))
        for index, value in objective.items():
            cost[index] = value
        data, row_index, column_index = [], [], []
        for row, (coefficients, _, _) in enumerate(self.rows):
            for column, value in coefficients.items():
                if value != 0.0:
                    data.append(value)
                    row_index.append(row)
                    column_index.append(column)
        matrix = sparse.coo_matrix((data, (row_index, column_index)), shape=(len(self.rows), len(cost)))
        constraint = optimize.LinearConstraint(matrix.tocsr(), [r[1] for r in self.rows], [r[2] for r in self.rows])
        return optimize.milp(cost, constraints=constraint, integrality=np.array(self.integer),
                             bounds=optimize.Bounds(self.lower, self.upper),
                             options={"time_limit": time_limit_s, "mip_rel_gap": 1e-7})


def combine(*terms: Tuple[float, Expression]) -> Expression:
    """``sum(weight * expression)``."""
    coefficients: Dict[int, float] = {}
    constant = 0.0
    for weight, (expr_coefficients, expr_constant) in terms:
        for index, value in expr_coefficients.items():
            coefficients[index] = coefficients.get(index, 0.0) + weight * value
        constant += weight * expr_constant
    return coefficients, constant


def var(index: int) -> Expression:
    """The variable ``index`` as an expression."""
    return {index: 1.0}, 0.0


def const(value: float) -> Expression:
    """The constant ``value`` as an expression."""
    return {}, float(value)
