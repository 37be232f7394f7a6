"""Tests of the pgoutput decoder (``cdcd.protocol``): golden captures, an encoder, properties."""
