"""Examples shipped with autopar.

``examples.zoo`` holds the built-in model zoo (GPT, Llama, MoE, Wide-ResNet, MLP) that the planner, the CLI, the
tests and the benchmarks use: ``from examples.zoo import build, list_models, ModelSpec``.
"""

__all__: list[str] = []
