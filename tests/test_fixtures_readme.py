"""fixtures/README.md holds the numbers profclass measures on the committed corpus now."""
import importlib.util

from conftest import ROOT


def test_fixtures_readme_is_up_to_date(diagnosis, capsys):
    spec = importlib.util.spec_from_file_location("measure", ROOT / "fixtures" / "measure.py")
    measure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(measure)
    # measure.py --check, on this session's cached diagnoses of the same committed files
    status = measure.check(diagnose=diagnosis)
    assert status == 0, capsys.readouterr().err
