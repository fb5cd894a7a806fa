"""Print one closing line for CI from the JUnit XML that each py_test wrote: 'N passed, N failed, N skipped'.

Arguments: test-log directories (default ``bazel-testlogs``), each holding ``tests/**/test.xml``; their cases are
counted together."""

import glob
import sys
import xml.etree.ElementTree as ET

passed = failed = skipped = 0
for root in sys.argv[1:] or ["bazel-testlogs"]:
    for path in glob.glob(f"{root}/tests/**/test.xml", recursive=True):
        for case in ET.parse(path).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
            elif case.find("skipped") is not None:
                skipped += 1
            else:
                passed += 1
print(f"{passed} passed, {failed} failed, {skipped} skipped")
