// difftrain rate: keyboard-first rating. Pairwise: 1/← left, 2/→ right, 3/t tie, 4/b both bad, 0/s skip.
// Ranking: press candidates' numbers best first (or drag one onto another), Backspace takes the last back, r resets,
// Enter sends. Everywhere: u undoes the last answer. One idempotency key per page: a retried send counts once.
// No GET takes an item: a page without one posts its form (POST /next) at once, and after an answer the script takes
// the next one (POST /api/next) before it shows it.
"use strict";
(function () {
  const state = document.getElementById("state");
  if (!state) return;
  const csrf = state.dataset.csrf;
  const status = document.getElementById("status");
  const key = (self.crypto && crypto.randomUUID) ? crypto.randomUUID() : String(Date.now()) + Math.random();
  let busy = false;

  function say(text) { if (status) status.textContent = text; }

  async function post(url, body) {
    const r = await fetch(url, {method: "POST", credentials: "same-origin",
      headers: {"Content-Type": "application/json", "X-CSRF-Token": csrf}, body: JSON.stringify(body || {})});
    let data = {};
    try { data = await r.json(); } catch (e) { data = {}; }
    return [r.status, data];
  }

  async function undo() {
    if (busy) return;
    busy = true;
    const [code, data] = await post("/api/undo");
    busy = false;
    if (code === 200 && data.undone) { location.assign("/"); } else { say(code === 200 ? "Nothing to undo." : (data.error || "Undo failed.")); }
  }
  const undoButton = document.getElementById("undo");
  if (undoButton) undoButton.addEventListener("click", undo);

  if (state.dataset.take) {
    const take = document.getElementById("take");
    if (take) take.submit();
    return;
  }
  if (!state.dataset.assignment) {
    document.addEventListener("keydown", e => { if (e.key === "u") undo(); });
    return;
  }
  const assignment = Number(state.dataset.assignment);
  const kind = state.dataset.kind;
  const questions = state.dataset.questions.split(",");
  const figures = Array.from(document.querySelectorAll(".candidate"));
  const handles = figures.map(f => f.dataset.handle);
  const question = document.getElementById("question");
  const extra = {};
  let q = 0;

  async function send(order, outcome) {
    if (busy) return;
    busy = true;
    say("Sending…");
    const [code, data] = await post("/api/answer", {assignment, key, order, outcome, extra});
    busy = false;
    if (code === 200) { await showNext(); return; }
    say((data.error || "The answer was not saved") + (code >= 500 || code === 0 ? " — press the key again to retry." : ""));
    if (code === 409) setTimeout(() => location.reload(), 1500);
  }

  async function showNext() {
    const [code, data] = await post("/api/next");
    if (code === 200) { location.assign(data.item ? "/" : "/done"); return; }
    say((data.error || "The next item could not be taken") + " — reloading.");
    setTimeout(() => location.assign("/"), 1500);
  }

  function showQuestion() {
    if (!question) return;
    const names = {overall: "Which is better overall?", aesthetics: "Which looks better?", prompt_fit: "Which fits the prompt better?"};
    question.textContent = kind === "pairwise" ? names[questions[q]] + (questions.length > 1 ? ` (${q + 1} of ${questions.length})` : "")
                                                : "Rank the candidates, best first.";
  }
  showQuestion();

  // ---- pairwise --------------------------------------------------------------------------------------
  let main = null;
  function choose(choice) {
    if (choice === "skip") { send([], "skip"); return; }
    if (q === 0) {
      if (choice === "both_bad") { send([], "both_bad"); return; }
      main = choice;
    } else {
      if (choice === "both_bad") return;
      extra[questions[q]] = choice === "tie" ? "tie" : handles[Number(choice)];
    }
    q += 1;
    if (q < questions.length) { showQuestion(); return; }
    if (main === "tie") { send([], "tie"); return; }
    const w = Number(main);
    send([handles[w], handles[1 - w]], "ranked");
  }

  // ---- ranking ---------------------------------------------------------------------------------------
  let ranked = [];
  function paint() {
    figures.forEach(f => {
      const i = ranked.indexOf(f.dataset.handle);
      f.querySelector(".rank").textContent = i < 0 ? "" : "#" + (i + 1);
      f.classList.toggle("ranked", i >= 0);
    });
  }
  function pick(index) {
    const h = handles[index];
    if (h === undefined || ranked.includes(h)) return;
    ranked.push(h);
    if (ranked.length === handles.length - 1) ranked.push(handles.find(x => !ranked.includes(x)));
    paint();
  }
  function submitRanking() {
    if (ranked.length !== handles.length) { say(`Rank all ${handles.length} first (${ranked.length} so far).`); return; }
    send(ranked.slice(), "ranked");
  }
  let dragged = null;
  figures.forEach(f => {
    f.addEventListener("dragstart", () => { dragged = f.dataset.handle; });
    f.addEventListener("dragover", e => e.preventDefault());
    f.addEventListener("drop", e => {
      e.preventDefault();
      if (kind !== "ranking" || !dragged || dragged === f.dataset.handle) return;
      if (ranked.length !== handles.length) ranked = figures.map(x => x.dataset.handle);
      ranked.splice(ranked.indexOf(dragged), 1);
      ranked.splice(ranked.indexOf(f.dataset.handle), 0, dragged);
      paint();
    });
    f.addEventListener("click", () => { if (kind === "ranking") pick(figures.indexOf(f)); });
  });

  document.querySelectorAll("[data-choice]").forEach(b => b.addEventListener("click", () => choose(b.dataset.choice)));
  const sendButton = document.getElementById("send");
  if (sendButton) sendButton.addEventListener("click", submitRanking);
  const resetButton = document.getElementById("reset");
  if (resetButton) resetButton.addEventListener("click", () => { ranked = []; paint(); });

  document.addEventListener("keydown", e => {
    if (e.ctrlKey || e.metaKey || e.altKey) return;
    const k = e.key;
    if (k === "u") { undo(); return; }
    if (kind === "pairwise") {
      const map = {"1": "0", "ArrowLeft": "0", "2": "1", "ArrowRight": "1", "3": "tie", "t": "tie", "4": "both_bad",
                   "b": "both_bad", "0": "skip", "s": "skip"};
      if (k in map) { e.preventDefault(); choose(map[k]); }
      return;
    }
    if (/^[1-9]$/.test(k)) { pick(Number(k) - 1); return; }
    if (k === "Backspace") { e.preventDefault(); ranked.pop(); if (ranked.length === handles.length - 1) ranked.pop(); paint(); return; }
    if (k === "r") { ranked = []; paint(); return; }
    if (k === "Enter") { e.preventDefault(); submitRanking(); return; }
    if (k === "s" || k === "0") send([], "skip");
  });
})();
