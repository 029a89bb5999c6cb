"""What the command line shows people (docs/SPEC.md §10): stored text made safe to print."""

from trialledger.adapters.console.plain import plain, printable

__all__ = ["plain", "printable"]
