"""The rating app in a real Chromium (Debian's, driven by Playwright through ``executable_path``; nothing is
downloaded): sign in, rate a pair by keyboard, undo, rank K by number keys, the admin page's figures."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from sqlalchemy import select

from difftrain_rate.batches import import_batch
from difftrain_rate.db import Answer, Assignment, Database, upgrade

from rate_helpers import PASSWORD, add_users, candidates_folder
from rate_server import Server

pytestmark = pytest.mark.slow

CHROMIUM = next((p for p in ("/usr/lib/chromium/chromium", shutil.which("chromium") or "") if p and Path(p).exists()),
                None)


@pytest.fixture
def browser():
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("no chromium: CI installs Debian's chromium (.ci/run)")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def _sign_in(page, url: str, name: str) -> None:
    page.goto(url + "/login")
    page.fill("#name", name)
    page.fill("#password", PASSWORD)
    page.click("#signin")
    page.wait_for_load_state("networkidle")


def _assignment(page) -> int:
    return int(page.get_attribute("#state", "data-assignment"))


def _handles(page) -> list[str]:
    return [page.get_attribute(f".candidate:nth-child({i + 1})", "data-handle")
            for i in range(page.locator(".candidate").count())]


def test_sign_in_rate_by_keyboard_undo_rank_and_admin(browser, tmp_path):
    url = str(tmp_path / "rate.db")
    upgrade(url)
    db = Database(url)
    add_users(db, "alice")
    add_users(db, "root", role="admin")
    import_batch(db, "pairs", [str(candidates_folder(tmp_path / "p", prompts=2, k=2))], kind="pairwise", raters=1)
    import_batch(db, "rank", [str(candidates_folder(tmp_path / "r", prompts=2, k=3, prompt="rank {p}"))],
                 kind="ranking", raters=1, seed=0)
    import_batch(db, "questions", [str(candidates_folder(tmp_path / "q", prompts=1, k=2, prompt="ask {p}"))],
                 kind="pairwise", raters=1, questions=["overall", "aesthetics"])
    server = Server(url, workers=1).start()
    try:
        page = browser.new_page()
        _sign_in(page, server.url, "alice")
        assert page.url.rstrip("/") == server.url and page.locator("#prompt").inner_text().startswith("a red circle")
        assert page.locator(".candidate img").evaluate_all("imgs => imgs.every(i => i.naturalWidth === 32)")
        first, left = _assignment(page), _handles(page)[0]
        page.keyboard.press("ArrowLeft")                                   # left is better
        page.wait_for_selector(f"#state:not([data-assignment='{first}'])", state="attached")
        with db.read() as s:
            ans = s.scalar(select(Answer).where(Answer.assignment_id == first))
        assert ans.order[0] == left and ans.outcome == "ranked"
        page.keyboard.press("u")                                           # undo: the same item again
        page.wait_for_selector(f"#state[data-assignment='{first}']", state="attached")
        with db.read() as s:
            assert s.scalar(select(Answer).where(Answer.assignment_id == first)) is None
        page.keyboard.press("3")                                           # a tie this time
        page.wait_for_selector(f"#state:not([data-assignment='{first}'])", state="attached")
        second = _assignment(page)
        page.keyboard.press("2")                                           # right is better
        page.wait_for_selector(f"#state:not([data-assignment='{second}'])", state="attached")
        # Ranking of K = 3 by number keys: 3, then 1 (the last follows), Enter.
        assert page.locator("#prompt").inner_text().startswith("rank") and page.locator(".candidate").count() == 3
        third, h = _assignment(page), _handles(page)
        page.keyboard.press("3")
        page.keyboard.press("1")
        assert page.locator(".candidate.ranked").count() == 3
        page.keyboard.press("Enter")
        page.wait_for_selector(f"#state:not([data-assignment='{third}'])", state="attached")
        # The next ranking by dragging: the third candidate onto the first puts it first.
        fourth, h4 = _assignment(page), _handles(page)
        page.drag_and_drop(".candidate:nth-child(3)", ".candidate:nth-child(1)")
        assert page.locator(".candidate.ranked").count() == 3
        page.keyboard.press("Enter")
        page.wait_for_selector(f"#state:not([data-assignment='{fourth}'])", state="attached")
        # An extra question: overall (1: left), then aesthetics (2: right).
        assert page.locator("#prompt").inner_text() == "ask 0"
        fifth, h5 = _assignment(page), _handles(page)
        assert "overall" in page.locator("#question").inner_text()
        page.keyboard.press("1")
        assert "looks better" in page.locator("#question").inner_text()
        page.keyboard.press("2")
        page.wait_for_selector("#done")
        with db.read() as s:
            answers = {a.assignment_id: a for a in s.scalars(select(Answer))}
            n_assign = len(s.scalars(select(Assignment)).all())
        assert answers[first].outcome == "tie" and answers[third].order == [h[2], h[0], h[1]]
        assert answers[fourth].order == [h4[2], h4[0], h4[1]]
        assert answers[fifth].order == [h5[0], h5[1]] and answers[fifth].extra == {"aesthetics": h5[1]}
        assert answers[second].order[0] == s_right(answers[second], second, db)
        assert len(answers) == 5 and n_assign == 5
        # The admin page shows the figures.
        admin = browser.new_page()
        _sign_in(admin, server.url, "root")
        admin.goto(server.url + "/admin")
        assert admin.locator("tr[data-batch='pairs'] .complete").inner_text() == "2 / 2"
        assert admin.locator("tr[data-batch='rank'] .complete").inner_text() == "2 / 2"
        assert "aesthetics" in admin.locator("tr[data-batch='questions'] .alpha").inner_text()
        assert admin.locator("tr[data-rater='alice'] .answers").inner_text() == "5"
        # A rater's page offers no admin link, and the admin page refuses them.
        assert page.locator("a[href='/admin']").count() == 0
        assert page.goto(server.url + "/admin").status == 403
    finally:
        server.stop()


def s_right(answer, assignment_id: int, db) -> str:
    """The handle shown on the right of an assignment (its order as served)."""
    with db.read() as s:
        return s.get(Assignment, assignment_id).order[1]
