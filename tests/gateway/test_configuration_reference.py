# docs/configuration.md against the gateway: its generated part is what `cellblock-gateway
# --print-config-reference` prints (made from the one table of settings,
# gateway/src/common/settings_table.cpp), so a setting added, renamed or changed in the code without the
# documentation fails here.
import subprocess
from pathlib import Path

from gateway_harness import gateway_binary

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
BEGIN = "<!-- BEGIN cellblock-gateway --print-config-reference -->\n"
END = "<!-- END cellblock-gateway --print-config-reference -->\n"


def documented():
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC} lacks its generated part's markers"
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)]


def test_docs_configuration_md_is_what_the_gateway_says():
    printed = subprocess.run([gateway_binary(), "--print-config-reference"], capture_output=True, text=True,
                             timeout=30)
    assert printed.returncode == 0, printed.stderr
    assert documented() == printed.stdout, (
        f"{DOC} is out of date: replace its part between the markers with the output of "
        "`cellblock-gateway --print-config-reference`")


def test_every_flag_in_the_reference_is_one_the_gateway_takes():
    # The reference's flags come from the same table as the command line; --help is CLI11's own list.
    help_text = subprocess.run([gateway_binary(), "--help"], capture_output=True, text=True, timeout=30).stdout
    flags = {word.strip("`,") for line in documented().splitlines() for word in line.split()
             if word.startswith("`--")}
    assert flags, "no flag in the reference"
    missing = sorted(flag for flag in flags if flag not in help_text)
    assert not missing, missing
