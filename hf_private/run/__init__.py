"""The run's privacy state, apart from the Trainer: plan, ledger, secret streams, engine, stages, budget, resume."""
