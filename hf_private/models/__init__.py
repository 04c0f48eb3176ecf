"""Facts about a model that every layer needs: the mean-pooled heads and their choice, refused model families, PEFT."""
