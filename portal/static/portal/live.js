// Live pages: every region marked data-live="name" is refreshed from a fresh
// copy of the same page every few seconds, without a reload. The page itself
// is the fragment source, so a region shows exactly what the view allows the
// reader to see; a 404 or 403 (the job is gone, the session ended) stops the
// polling and says so. Polling pauses while the tab is hidden.
//
// The same script counts down to data-countdown deadlines (corrected by the
// server's clock from the Date header) and follows a log (#log-follow) by
// asking the plain-text log for the bytes after the last offset, as
// `qm logs --follow` does.
(function () {
  "use strict";
  var status = document.querySelector("[data-live-status]");
  var regions = document.querySelectorAll("[data-live]");
  var period = 1000 * Number((status && status.getAttribute("data-live-seconds")) || 5);
  var lastUpdate = Date.now();
  var skew = 0;  // server clock minus this browser's clock, in ms
  var stopped = false;
  var timer = null;

  function learnSkew(response) {
    var date = response.headers.get("Date");
    if (date) { skew = new Date(date).getTime() - Date.now(); }
  }

  function plural(count, word) { return count + " " + word + (count === 1 ? "" : "s"); }

  function tick() {
    if (status && !stopped) {
      var ago = Math.max(0, Math.round((Date.now() - lastUpdate) / 1000));
      var label = status.querySelector("[data-updated-ago]");
      if (label) { label.textContent = plural(ago, "second"); }
    }
    document.querySelectorAll("[data-countdown]").forEach(function (element) {
      var deadline = new Date(element.getAttribute("data-countdown")).getTime();
      var left = Math.round((deadline - (Date.now() + skew)) / 1000);
      element.textContent = left > 0 ? plural(left, "second") + " left" : "deadline passed";
    });
  }

  function refresh() {
    if (stopped || document.hidden) { return schedule(); }
    fetch(window.location.href, { credentials: "same-origin",
                                  headers: { "X-Requested-With": "fetch" } })
      .then(function (response) {
        if (response.status === 404 || response.status === 403) {
          stopped = true;
          status.textContent = "Live updates stopped: this page is no longer available to you.";
          return null;
        }
        if (!response.ok) { throw new Error(String(response.status)); }
        learnSkew(response);
        return response.text();
      })
      .then(function (html) {
        if (html === null) { return; }
        var fresh = new DOMParser().parseFromString(html, "text/html");
        regions.forEach(function (region) {
          var name = region.getAttribute("data-live");
          var replacement = fresh.querySelector('[data-live="' + name + '"]');
          if (replacement && replacement.innerHTML !== region.innerHTML) {
            region.innerHTML = replacement.innerHTML;
          }
        });
        lastUpdate = Date.now();
        if (status) { status.classList.remove("stale"); }
        tick();
        schedule();
      })
      .catch(function () {
        // A failed poll keeps the last figures and says how old they are.
        if (status) { status.classList.add("stale"); }
        schedule();
      });
  }

  function schedule() {
    window.clearTimeout(timer);
    if (!stopped) { timer = window.setTimeout(refresh, period); }
  }

  // --- following a log ---------------------------------------------------------------
  var follow = document.getElementById("log-follow");
  var log = document.getElementById("log");
  var LOG_KEEP = 1 << 20;  // characters kept on the page; older text is dropped
  function pollLog() {
    if (!follow.checked || document.hidden) { return; }
    var offset = follow.getAttribute("data-offset");
    fetch(follow.getAttribute("data-url") + "?raw=1&offset=" + offset,
          { credentials: "same-origin" })
      .then(function (response) {
        if (!response.ok) { throw new Error(String(response.status)); }
        var next = response.headers.get("X-Next-Offset");
        var open = response.headers.get("X-Attempt-Open");
        return response.text().then(function (text) { return [text, next, open]; });
      })
      .then(function (answer) {
        var text = answer[0];
        if (text) {
          log.hidden = false;
          log.textContent = (log.textContent + text).slice(-LOG_KEEP);
          window.scrollTo(0, document.documentElement.scrollHeight);
          var empty = document.getElementById("log-empty");
          if (empty) { empty.hidden = true; }
        }
        if (answer[1] !== null) { follow.setAttribute("data-offset", answer[1]); }
        if (answer[2] === "0" && !text) {
          // The attempt ended and everything it wrote is shown: the log is complete.
          follow.checked = false;
          follow.disabled = true;
          document.getElementById("log-follow-state").textContent = "The attempt has ended; the log is complete.";
        }
        lastUpdate = Date.now();
        tick();
      })
      .catch(function () { if (status) { status.classList.add("stale"); } });
  }
  if (follow && log) {
    window.setInterval(pollLog, 2000);
    follow.addEventListener("change", pollLog);
  }

  if (regions.length && status) { schedule(); }
  if (status || document.querySelector("[data-countdown]")) {
    window.setInterval(tick, 1000);
    tick();
  }
  document.addEventListener("visibilitychange", function () {
    if (!document.hidden && !stopped && regions.length) { refresh(); }
  });
})();

// A form marked data-confirm asks before it is sent (cancelling a job). The
// listener sits on the document, so it keeps working when a live region is
// replaced.
document.addEventListener("submit", function (event) {
  "use strict";
  var message = event.target.getAttribute && event.target.getAttribute("data-confirm");
  if (message && !window.confirm(message)) { event.preventDefault(); }
});

// On a narrow screen the navigation folds behind the Menu button.
(function () {
  "use strict";
  var toggle = document.querySelector(".navtoggle");
  if (!toggle) { return; }
  toggle.addEventListener("click", function () {
    var open = toggle.closest(".topbar").classList.toggle("open");
    toggle.setAttribute("aria-expanded", open ? "true" : "false");
  });
})();
