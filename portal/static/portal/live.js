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
  // The log is kept as one <span class="line"> per line, so that the trap's
  // `QM_EVENT {json}` lines can be hidden by a class on the <pre> and the newest
  // line can be scrolled to. Following keeps the newest line in view (the <pre>
  // is a scroll box of its own, and the page scrolls too) until the reader
  // scrolls up or unticks it.
  var follow = document.getElementById("log-follow");
  var log = document.getElementById("log");
  var showEvents = document.getElementById("log-events");
  var LOG_KEEP = 1 << 20;  // characters kept on the page; older lines are dropped
  var EVENT_MARKER = "QM_EVENT ";  // gracetrap_protocol.EVENT_PREFIX
  var logLength = 0;
  var followState = document.getElementById("log-follow-state");
  var followWords = followState ? followState.textContent : "";

  function lineElement(line) {
    var span = document.createElement("span");
    span.className = "line";
    var at = line.indexOf(EVENT_MARKER);
    if (at < 0) {
      span.textContent = line;
    } else if (line.slice(0, at).trim() === "") {
      span.className = "line qm-event";
      span.textContent = line;
    } else {
      // Another process's output ran into the event without a newline: only
      // the event's part of the line is an event.
      var body = line.replace(/\n$/, "");
      var event = document.createElement("span");
      event.className = "qm-event";
      event.textContent = body.slice(at);
      span.appendChild(document.createTextNode(body.slice(0, at)));
      span.appendChild(event);
      if (body.length < line.length) { span.appendChild(document.createTextNode("\n")); }
    }
    return span;
  }

  function appendLog(text) {
    // A line cut short by the last chunk is completed by this one.
    var last = log.lastElementChild;
    if (last && last.textContent.slice(-1) !== "\n") {
      text = last.textContent + text;
      logLength -= last.textContent.length;
      log.removeChild(last);
    }
    var lines = document.createDocumentFragment();
    var start = 0;
    while (start < text.length) {
      var end = text.indexOf("\n", start);
      end = end < 0 ? text.length : end + 1;
      lines.appendChild(lineElement(text.slice(start, end)));
      start = end;
    }
    log.appendChild(lines);
    logLength += text.length;
    while (logLength > LOG_KEEP && log.firstElementChild) {
      logLength -= log.firstElementChild.textContent.length;
      log.removeChild(log.firstElementChild);
    }
    countEvents();
  }

  function countEvents() {
    var label = document.getElementById("log-events-count");
    if (!label) { return; }
    var count = log.querySelectorAll(".qm-event").length;
    label.textContent = count === 1 ? "1 event line" : count + " event lines";
  }

  function applyEvents() {
    log.classList.toggle("hide-events", !showEvents.checked);
    if (follow && follow.checked) { toBottom(); }
  }

  var lastWindowY = window.scrollY;
  function toBottom() {
    log.scrollTop = log.scrollHeight;
    window.scrollTo(0, document.documentElement.scrollHeight);
    lastWindowY = window.scrollY;
  }

  function stopFollowing() {
    if (!follow.checked) { return; }
    follow.checked = false;
    if (followState) { followState.textContent = "Paused while you read back; tick Follow to go on."; }
  }

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
          appendLog(text);
          if (follow.checked) { toBottom(); }
          var empty = document.getElementById("log-empty");
          if (empty) { empty.hidden = true; }
        }
        if (answer[1] !== null) { follow.setAttribute("data-offset", answer[1]); }
        if (answer[2] === "0" && !text) {
          // The attempt ended and everything it wrote is shown: the log is complete.
          follow.checked = false;
          follow.disabled = true;
          followWords = "The attempt has ended; the log is complete.";
          if (followState) { followState.textContent = followWords; }
        }
        lastUpdate = Date.now();
        tick();
      })
      .catch(function () { if (status) { status.classList.add("stale"); } });
  }

  if (log) {
    var initial = log.textContent;
    log.textContent = "";
    appendLog(initial);
  }
  if (log && showEvents) {
    // The control works only with this script, so only the script shows it.
    document.getElementById("log-events-control").hidden = false;
    showEvents.addEventListener("change", applyEvents);
    applyEvents();
  }
  if (follow && log) {
    window.setInterval(pollLog, 2000);
    follow.addEventListener("change", function () {
      if (follow.checked) {
        if (followState) { followState.textContent = followWords; }
        toBottom();
      }
      pollLog();
    });
    // Reading back stops following: scrolling the log up, or the page up.
    log.addEventListener("scroll", function () {
      if (log.scrollTop + log.clientHeight < log.scrollHeight - 4) { stopFollowing(); }
    });
    window.addEventListener("scroll", function () {
      if (window.scrollY < lastWindowY - 4) { stopFollowing(); }
      lastWindowY = window.scrollY;
    });
    if (follow.checked) { toBottom(); }
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
