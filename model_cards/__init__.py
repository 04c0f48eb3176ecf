"""Model card templates rendered by `hf_private.release.model_card` (installed as `hf_private.model_cards`)."""
