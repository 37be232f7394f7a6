"""Decoding stage: pgoutput column values to Avro binary, with the type catalog they need."""
