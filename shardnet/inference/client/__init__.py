"""The requester: routing, sessions, the decode loop, speculation, healing, audits, run receipts.

Never imports ``inference/server`` (tests/unit/test_layering.py): the two meet only on the wire and in
the activation router."""
