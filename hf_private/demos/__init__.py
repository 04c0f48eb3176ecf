"""Embedded offline demo data (sentiment, instructions, preferences): the default of the recipes and the tests."""
