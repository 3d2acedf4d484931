"""Choosing plans: the planner, the FlexFlow-style search, the families' search and the
scaling and crossover analyses."""
