"""Avro binary primitives, below every stage that writes Avro bytes.

Both ``cdcd.decode`` (column values straight to Avro bytes) and
``cdcd.envelope`` (records around them) write Avro, so the encoding lives
under both rather than in either: see :mod:`cdcd.avro.binary`.
"""
