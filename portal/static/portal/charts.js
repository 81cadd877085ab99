// Draws every figure the server embedded as JSON next to its chart element.
(function () {
  "use strict";
  if (!window.Plotly) { return; }
  var config = { displaylogo: false, responsive: true,
                 modeBarButtonsToRemove: ["lasso2d", "select2d"] };
  document.querySelectorAll(".plot[data-figure]").forEach(function (element) {
    var source = document.getElementById(element.getAttribute("data-figure"));
    if (!source) { return; }
    var figure = JSON.parse(source.textContent);
    window.Plotly.newPlot(element, figure.data || [], figure.layout || {}, config);
  });
})();
