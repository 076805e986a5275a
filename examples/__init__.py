"""Examples of an env and a network of your own (README "Your own env and model")."""
