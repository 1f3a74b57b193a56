"""``python -m profclass.contract_cli``: print a shipped schema, update the released field list
(``--fields``), regenerate docs/json.md (``--docs``). Its own module, so that ``contract`` (read
by every run) and ``contract_docs`` (which reads ``contract``) do not import each other."""
from __future__ import annotations

import sys

from . import contract
from .contract_docs import render_docs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--fields"]:
        if len(argv) > 1:
            try:
                contract.update_fields(argv[1])
            except ValueError as exc:
                sys.stderr.write(f"profclass.contract_cli: {argv[1]}: {exc}\n")
                return 2
        else:
            sys.stdout.write(contract.fields_text())
        return 0
    if argv[:1] == ["--docs"]:
        text = render_docs()
        if len(argv) > 1:
            with open(argv[1], "w", encoding="utf-8") as fh:
                fh.write(text)
        else:
            sys.stdout.write(text)
        return 0
    if argv[:1] and argv[0] in contract.SCHEMA_KINDS:
        sys.stdout.write(contract.schema_text(argv[0]))
        return 0
    sys.stderr.write("usage: python -m profclass.contract_cli diagnose|diff | --fields [FILE] | --docs [FILE]\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
