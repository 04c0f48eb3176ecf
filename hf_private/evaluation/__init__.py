"""The privacy side of `evaluate()`: held-out verdicts, training rows in other guises, the collapse warning, metrics."""
