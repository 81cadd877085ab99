// The job form offers the priority classes of the team chosen: when the team
// changes, its classes replace the list and its default class is chosen, as a
// job submitted without a class would get it. The page also says how many GPUs
// ranks × GPUs per rank make, for an elastic job at each size it may run at.
// Without JavaScript the server's list for the first (or the earlier job's) team
// stays, and the API refuses a class the team may not use.
(function () {
  "use strict";
  var form = document.getElementById("job-submit-form");
  var data = document.getElementById("team-priority-classes");
  if (!form || !data) { return; }
  var classes = JSON.parse(data.textContent);
  var team = form.querySelector('[name="team"]');
  var priority = form.querySelector('[name="priority_class"]');
  var ranks = form.querySelector('[name="ranks"]');
  var gpus = form.querySelector('[name="gpus_per_rank"]');
  var total = document.getElementById("gpu-total");

  function offerClasses() {
    var allowance = classes[team.value] || { allowed: [], "default": null };
    while (priority.firstChild) { priority.removeChild(priority.firstChild); }
    allowance.allowed.forEach(function (pair) {
      var option = document.createElement("option");
      option.value = pair[0];
      option.textContent = pair[1];
      option.selected = pair[0] === allowance["default"];
      priority.appendChild(option);
    });
  }

  // The sizes typed: "8", a range "2:8" or a list "2,4,8"; null unless each is a
  // whole number above 0 (the server says what is wrong with anything else).
  function sizes(text) {
    var parts = text.indexOf(":") >= 0 ? text.split(":") : text.split(",");
    if (text.indexOf(":") >= 0 && parts.length !== 2) { return null; }
    var numbers = parts.map(function (part) { return part.trim() === "" ? NaN : Number(part); });
    var whole = numbers.every(function (n) { return Number.isInteger(n) && n > 0; });
    return whole ? numbers : null;
  }

  function gpuWords(n) { return n.toLocaleString("en") + " GPU" + (n === 1 ? "" : "s"); }

  function showTotal() {
    var asked = sizes(ranks.value), g = Number(gpus.value);
    if (!asked || gpus.value === "" || !Number.isInteger(g) || g <= 0) {
      total.textContent = "";
    } else if (asked.length === 1) {
      total.textContent = "= " + gpuWords(asked[0] * g);
    } else if (ranks.value.indexOf(":") >= 0) {
      total.textContent = "= " + (asked[0] * g).toLocaleString("en") + " to " + gpuWords(asked[1] * g);
    } else {
      var each = asked.map(function (r) { return (r * g).toLocaleString("en"); });
      total.textContent = "= " + each.slice(0, -1).join(", ") + " or " + each[each.length - 1] + " GPUs";
    }
  }

  if (team && priority) { team.addEventListener("change", offerClasses); }
  if (ranks && gpus && total) {
    ranks.addEventListener("input", showTotal);
    gpus.addEventListener("input", showTotal);
    showTotal();
  }
})();
