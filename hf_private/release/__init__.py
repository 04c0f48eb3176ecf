"""What leaves the machine: artefact names and the allow-list, private adapters, checkpoints, the model card."""
