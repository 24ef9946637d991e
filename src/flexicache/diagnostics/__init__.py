"""What the page selection loses: true attention beside FlexiCache's, the oracle's and the best tokens' selection
(``flexicache diagnose``)."""
