/* The Resource pools card: refresh every few seconds, cancel with a confirmation.
 *
 * Plain script, no dependencies. The card's HTML comes from the server (the same
 * template as the first render), so this file only fetches and swaps it. A refresh is
 * skipped while the tab is hidden or while the keyboard focus is inside the card, so
 * that a keyboard user's place is never pulled away from under them.
 */
"use strict";
(function () {
  const card = document.getElementById("pools-card");
  if (!card || !window.fetch) {
    return;
  }
  const url = card.dataset.refreshUrl;
  const every = (parseInt(card.dataset.refreshSeconds, 10) || 5) * 1000;
  const KEEP_MESSAGE_MS = 15000;
  let busy = false;
  let last = null; // {text, level, at}: survives the next refreshes for a while

  function show() {
    const box = card.querySelector("[data-pools-message]");
    if (!box) {
      return;
    }
    if (last && Date.now() - last.at < KEEP_MESSAGE_MS) {
      box.textContent = last.text;
      box.className = "pools-card-status is-" + last.level;
    } else {
      box.textContent = "";
      box.className = "pools-card-status";
    }
  }

  function remember(text, level) {
    last = {text: text, level: level, at: Date.now()};
    show();
  }

  async function refresh(force) {
    if (busy || (!force && document.hidden)) {
      return;
    }
    const focused = document.activeElement;
    if (!force && focused && focused !== document.body && card.contains(focused)) {
      return;
    }
    busy = true;
    try {
      const response = await fetch(url, {
        credentials: "same-origin",
        cache: "no-store",
        headers: {"X-Requested-With": "XMLHttpRequest"},
      });
      if (response.ok) {
        card.innerHTML = await response.text();
        card.classList.remove("is-stale");
        show();
      } else {
        card.classList.add("is-stale");
        remember("Could not refresh the card (HTTP " + response.status + "); retrying.", "error");
      }
    } catch (error) {
      card.classList.add("is-stale");
      remember("The server did not answer; retrying.", "error");
    } finally {
      busy = false;
    }
  }

  card.addEventListener("submit", async function (event) {
    const form = event.target.closest("form.pools-cancel");
    if (!form) {
      return;
    }
    event.preventDefault();
    if (!window.confirm(form.dataset.confirm)) {
      return;
    }
    const button = form.querySelector("button");
    if (button) {
      button.disabled = true;
    }
    try {
      const response = await fetch(form.action, {
        method: "POST",
        body: new FormData(form),
        credentials: "same-origin",
        headers: {"Accept": "application/json", "X-Requested-With": "XMLHttpRequest"},
      });
      let data;
      try {
        data = await response.json();
      } catch (notJson) {
        data = {
          ok: false,
          message: response.status === 403
            ? "Not allowed: you may not cancel entries, or the page is stale (reload it)."
            : "Cancel failed (HTTP " + response.status + ").",
        };
      }
      const level = data.ok ? "success" : (response.status === 409 ? "warning" : "error");
      remember(data.message, level);
    } catch (error) {
      remember("Cancel failed: the server did not answer.", "error");
    }
    await refresh(true);
  });

  window.setInterval(function () { refresh(false); }, every);
  document.addEventListener("visibilitychange", function () {
    if (!document.hidden) {
      refresh(false);
    }
  });
})();
