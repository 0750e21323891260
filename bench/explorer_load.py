"""How long headless Chromium takes to load an attention-explorer page of
512 tokens (6 layers x 12 heads, rollout and attributions beside): the
navigation's loadEventEnd, over fresh loads of the same file.

    .venv/bin/python bench/explorer_load.py [--tokens 512] [--loads 7]

Needs Debian's chromium and chromium-driver (scripts/setup.sh installs
them) and selenium. Prints the file's size, each load's milliseconds, their
median, and whether the median is under the 2,000 ms target."""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile

import torch

from qkv import explorer

TARGET_MS = 2000.0


def chrome():
    from selenium import webdriver

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        sys.exit("explorer_load.py: chromium and chromium-driver are not installed "
                 "(scripts/setup.sh installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1500,900"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(driver))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--loads", type=int, default=7)
    a = ap.parse_args()
    if a.tokens < 1 or a.loads < 1:
        sys.exit("explorer_load.py: --tokens and --loads: expected >= 1")
    g = torch.Generator().manual_seed(0)
    maps = (torch.randn(6, 12, a.tokens, a.tokens, generator=g) * 3).softmax(-1)
    page = explorer.page([f"w{i}" for i in range(a.tokens)], maps,
                         title=f"{a.tokens} tokens", rollout=torch.eye(a.tokens),
                         attributions=torch.randn(a.tokens, generator=g))
    with tempfile.TemporaryDirectory() as folder:
        path = explorer.write_html(os.path.join(folder, "explorer.html"), [page])
        print(f"{a.tokens} tokens: {os.path.getsize(path) / 1e6:.2f} MB")
        driver = chrome()
        try:
            times = []
            for i in range(a.loads):
                driver.get("about:blank")
                driver.get(pathlib.Path(path).as_uri())
                times.append(float(driver.execute_script(
                    "return performance.getEntriesByType('navigation')[0].loadEventEnd")))
                print(f"load {i + 1}: {times[-1]:.0f} ms", flush=True)
        finally:
            driver.quit()
    median = statistics.median(times)
    verdict = "met" if median < TARGET_MS else "not met"
    print(f"median {median:.0f} ms (range {min(times):.0f}-{max(times):.0f}); "
          f"target < {TARGET_MS:.0f} ms: {verdict}")


if __name__ == "__main__":
    main()
