"""Quickstart: run code in a cellblock session. Needs CELLBLOCK_URL and CELLBLOCK_TOKEN in the environment."""
import os

from cellblock import Gateway
from cellblock.errors import SessionNotFound

gw = Gateway(os.environ["CELLBLOCK_URL"], os.environ["CELLBLOCK_TOKEN"])

with gw.session(name="quickstart") as session:
    session.files.write("sales.csv", "product,units\napple,3\npear,5\napple,4\n")
    session.run("import pandas as pd\ndf = pd.read_csv('sales.csv')")  # state is kept between runs
    execution = session.run("totals = df.groupby('product').units.sum()\n"
                            "print(', '.join(f'{k}={v}' for k, v in totals.items()))\n"
                            "int(df.units.sum())",
                            on_stdout=lambda text: print("live:", text, end=""))  # called as output arrives
    print("stdout:", execution.stdout, end="")
    print("result:", execution.result.text if execution.result else None)

    failed = session.run("1 / 0")
    print("error:", failed.error.ename if failed.error else None)

try:
    gw.attach("quickstart")
except SessionNotFound:
    print("deleted on exit")
