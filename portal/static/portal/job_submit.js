// The job form offers the priority classes of the team chosen: when the team
// changes, its classes replace the list and its default class is chosen, as a
// job submitted without a class would get it. The page also says how many GPUs
// ranks × GPUs per rank make. Without JavaScript the server's list for the first
// (or the earlier job's) team stays, and the API refuses a class the team may not use.
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

  function showTotal() {
    var r = Number(ranks.value), g = Number(gpus.value);
    var whole = ranks.value !== "" && gpus.value !== "" && Number.isInteger(r) && Number.isInteger(g) && r > 0 && g > 0;
    total.textContent = whole ? "= " + (r * g).toLocaleString("en") + " GPU" + (r * g === 1 ? "" : "s") : "";
  }

  if (team && priority) { team.addEventListener("change", offerClasses); }
  if (ranks && gpus && total) {
    ranks.addEventListener("input", showTotal);
    gpus.addEventListener("input", showTotal);
    showTotal();
  }
})();
