// The quota editor previews its consequences as the manager types: the form is
// posted to the preview endpoint, which validates like a save, saves nothing and
// answers the preview panel's HTML. Without JavaScript the Preview button does
// the same with a full page.
(function () {
  "use strict";
  var form = document.getElementById("quota-form");
  var panel = document.getElementById("preview");
  if (!form || !panel) { return; }
  var url = form.getAttribute("data-preview-url");
  var timer = null;
  var sequence = 0;

  // The preview's refusals are shown under the field they concern, as after a
  // full-page save; a refusal of the form as a whole stays in the panel.
  function placeErrors() {
    form.querySelectorAll(".field").forEach(function (field) {
      field.classList.remove("invalid");
      field.querySelectorAll("p.error").forEach(function (old) { old.remove(); });
    });
    form.querySelectorAll("[aria-invalid]").forEach(function (input) {
      input.removeAttribute("aria-invalid");
    });
    panel.querySelectorAll("[data-error-for]").forEach(function (source) {
      var input = form.querySelector('[name="' + source.getAttribute("data-error-for") + '"]');
      var field = input && input.closest(".field");
      if (!field) { return; }
      field.classList.add("invalid");
      var copy = document.createElement("p");
      copy.className = "error live";
      copy.setAttribute("role", "alert");
      copy.textContent = source.getAttribute("data-message") || source.textContent;
      field.appendChild(copy);
      input.setAttribute("aria-invalid", "true");
    });
  }

  function preview() {
    var mine = ++sequence;
    var body = new FormData(form);
    body.set("action", "preview");
    panel.classList.add("loading");
    fetch(url, { method: "POST", body: body, credentials: "same-origin",
                 headers: { "X-Requested-With": "fetch" } })
      .then(function (response) {
        // 400 carries the validation messages as a panel; anything else is a failure.
        if (!response.ok && response.status !== 400) { throw new Error(String(response.status)); }
        return response.text();
      })
      .then(function (html) {
        if (mine !== sequence) { return; }  // a newer preview is on its way
        panel.innerHTML = html;
        panel.classList.remove("loading");
        placeErrors();
      })
      .catch(function () {
        panel.classList.remove("loading");
        panel.innerHTML = '<p class="errors">The preview could not be loaded; use the Preview button.</p>';
      });
  }

  form.addEventListener("input", function () {
    window.clearTimeout(timer);
    timer = window.setTimeout(preview, 300);
  });
  document.getElementById("preview-button").addEventListener("click", function (event) {
    event.preventDefault();
    window.clearTimeout(timer);
    preview();
  });
})();
