"""The simulator: cost models of compute, links, collectives and codecs, and the replay of a
plan's schedule on them."""
